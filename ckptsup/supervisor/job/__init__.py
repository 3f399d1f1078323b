"""ckptsup.supervisor.job"""
