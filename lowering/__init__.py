"""How to lower: targets, decomposition tables, op classes, kernel generators by op family.

Installed as ``torch_kernelize.lowering``; always import it by that name.
"""
