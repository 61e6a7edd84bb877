"""`verify`: the operation (`run`), its report (`report`), the structural check (`structure`) and checksum manifests (`checksums`)."""
