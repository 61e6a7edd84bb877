"""`diff`: the operation (`run`), value comparison (`compare`) and tied or aliased names (`aliases`)."""
