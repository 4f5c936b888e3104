"""streaming/loading"""
