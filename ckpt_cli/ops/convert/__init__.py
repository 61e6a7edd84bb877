"""`convert`: the operation (`run`) and its planning (`plan`)."""
