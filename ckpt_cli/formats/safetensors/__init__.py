"""safetensors: one file, or shards plus a `*.safetensors.index.json` (`format`), and the header codec (`header`)."""
