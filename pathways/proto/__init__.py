"""Generated from pathways/ifrt/schema by `python -m pathways.ifrt.schema`; do not edit."""
