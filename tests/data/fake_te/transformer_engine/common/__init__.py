"""The stand-in's common package (recipes)."""
