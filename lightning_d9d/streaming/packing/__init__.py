"""streaming/packing"""
