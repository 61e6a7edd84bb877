"""Which files beside a checkpoint's weights belong with the model: one rule for every command.

`download` fetches them from the Hub, `convert` / `reshard` carry them into DEST. Names only,
no I/O, no imports: both the Hub prelude and the transfer pipeline use this module.
"""

from __future__ import annotations

#: top-level files that belong with a model folder (config, tokenizer, card, custom code)
EXTRA_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken", ".vocab", ".spm", ".md", ".py")
#: (weight files, never extras: `formats.names.WEIGHT_SUFFIXES`)
#: an extra file larger than this is no config or tokenizer file: not carried
MAX_EXTRA_BYTES = 64 << 20
