"""clover.train: self-distillation of draft heads on the base model's own outputs (on a CPU or a GPU).

    data.py        conversations (ShareGPT, JSONL), the train/validation split, chat-template tokenisation
    corpus.py      the base's own answers as token-id shards under data/ with provenance (clover-data grow)
    features.py    the base's hidden states and top-k next-token distributions, built in batches on the base's
                   device, cached on disk once or kept in the device's memory
    objectives.py  per-depth losses (Clover-2: KL + 10 x SmoothL1, 0.7^d; Medusa / Clover: KL, 0.8^d)
    trainer.py     AdamW + warmup/cosine, per-epoch validation, checkpoints (mid-epoch under a time budget), resume

`clover-train` (clover.tools.train) drives them; the base model runs only while features are built.
"""
