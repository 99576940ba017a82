"""The controller: resource manager, lowering, island sequencing and dispatch."""
