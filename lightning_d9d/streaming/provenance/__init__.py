"""streaming/provenance"""
