"""Training code for the bundled demo model and its distilled draft.

`corpus` (documents and the held-out split), `tokenizer` (byte-level BPE and the chat template),
`examples` (chat examples that teach copying from documents), `trainer` (a causal LM trained on
packed, loss-masked rows within a time budget), `demo` (`ragspeed train-demo`), `distill`
(`ragspeed train-draft`).
"""
