"""`prune`: the operation (`run`), retention policies (`retention`) and slimming old saves (`slim`)."""
