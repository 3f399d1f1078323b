"""ckptsup.checkpoint"""
