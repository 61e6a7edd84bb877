"""What a SRC is: training layouts (one module per framework) and run folders (one judge, any storage)."""
