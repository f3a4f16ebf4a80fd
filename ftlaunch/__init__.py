"""ftlaunch: make LLaMA-Factory fine-tuning "just run" on the machine at hand.

Importing this package stays light: it never imports torch, transformers or llamafactory.
"""

__version__ = "0.1.0"
