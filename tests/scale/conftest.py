# The scenario files are run in child pytest sessions by the tests beside them, never directly.
collect_ignore = ["scenarios"]
