"""streaming/tokens"""
