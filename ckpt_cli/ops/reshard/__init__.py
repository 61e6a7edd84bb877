"""`reshard`: shard sizes and world sizes (`run`), whole training folders (`folder`), DCP world-size cuts (`world`), DeepSpeed ZeRO partitions (`zero`) and the resume verdict (`report`)."""
