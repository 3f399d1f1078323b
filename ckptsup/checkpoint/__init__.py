"""ckptsup.checkpoint: the torch-free checkpoint core (docs/checkpoint-core.md).

manifest (what a checkpoint is), hashing, commit (tmp dir -> manifest -> rename), validate
(levels 1-3, quarantine), catalog (latest committed/validated/durable), trust (who may be read),
retention, tiers + promote (node-local -> shared -> S3). Nothing here imports torch.
"""
