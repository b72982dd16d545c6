"""Settings: defaults <- YAML file <- dotted KEY=VALUE overrides -> one typed, checked Config.
Loads nothing heavy (no torch, no model), so every bad setting fails in one line before work starts.

schema.py    one dataclass field per option, with its help text; the defaults are the tiny CPU demo
validate.py  the invariants across fields, each failure naming its key and the allowed range
load.py      reading YAML and KEY=VALUE overrides into the schema; saving and reading run configs
keys.py      every dotted key as the user sees it (`dapo-train config --keys`, docs/configuration.md)
retired.py   removed or renamed keys, still readable in old run folders
naming.py    the automatic run name, and the run folder's name against the file system's limit
"""
