"""streaming/streams"""
