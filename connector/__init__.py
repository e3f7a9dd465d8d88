"""connector"""
