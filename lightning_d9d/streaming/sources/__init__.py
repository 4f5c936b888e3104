"""streaming/sources"""
