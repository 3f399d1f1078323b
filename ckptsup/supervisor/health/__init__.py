"""ckptsup.supervisor.health.health"""
