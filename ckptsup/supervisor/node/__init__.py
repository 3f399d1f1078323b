"""ckptsup.supervisor.node"""
