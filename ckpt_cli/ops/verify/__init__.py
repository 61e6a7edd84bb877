"""`verify`: the operation (`run`) and checksum manifests (`checksums`)."""
