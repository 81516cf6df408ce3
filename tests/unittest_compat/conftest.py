# The scenario files are run in child sessions (pytest and python -m unittest) by the tests beside them.
collect_ignore = ["scenarios"]
