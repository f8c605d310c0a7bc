from moeshard.cli import entry

# Guarded: spawned ranks re-import the main module and must not run the CLI again.
if __name__ == "__main__":
    raise SystemExit(entry())
