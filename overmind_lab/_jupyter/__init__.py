"""Jupyter integrations: patching ``from_pretrained``, the IPython magics, the ipywidgets
panel, the display helpers they share with the CLI, and the server extension (REST).
"""
