"""GGUF (llama.cpp) files: `format` reads and checks them."""
