"""ckptsup.slurm"""
