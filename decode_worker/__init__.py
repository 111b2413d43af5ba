"""decode_worker"""
