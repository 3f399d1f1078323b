"""ckptsup.supervisor.ops"""
