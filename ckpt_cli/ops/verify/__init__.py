"""`verify`: the operation (`run`), its report (`report`), the structural check (`structure`), the checksum checks (`checksums`) and the checksum manifest itself (`checksum_manifest`)."""
