"""Reports: plots now; HTML/markdown pages and gates build on the result JSON."""
