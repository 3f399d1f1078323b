"""ckptsup.supervisor"""
