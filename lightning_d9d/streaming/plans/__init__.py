"""streaming/plans"""
