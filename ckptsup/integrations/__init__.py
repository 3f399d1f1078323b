"""ckptsup.integrations: one small module per training stack (docs/integrations.md).

lightning.py  CkptsupCallback for lightning.pytorch.Trainer (extra `ckptsup[lightning]`)
hf.py         CkptsupCallback for transformers.Trainer, plus resume_path(trainer) (extra `ckptsup[hf]`)
framework_ckpt.py  the frameworks' own checkpoints (Lightning .ckpt, HF checkpoint-N) validated in place

Each module imports its framework only when used: `import ckptsup` never pulls one in.
"""
