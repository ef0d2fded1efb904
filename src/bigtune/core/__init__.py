"""The lowest layer: step arithmetic, the GPU catalog, bundled presets and assets, metrics, run folders
and the hub check. Nothing here imports another bigtune layer.
"""
