"""Training data: sources and formats (alpaca, text, chat, images with captions, labelled text), the
data report of skipped records, collators, packing and the epoch sampler.
"""
