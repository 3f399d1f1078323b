"""ckptsup.hooks"""
