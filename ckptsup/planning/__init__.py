"""ckptsup.planning"""
