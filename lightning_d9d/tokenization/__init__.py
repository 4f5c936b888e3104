"""tokenization"""
