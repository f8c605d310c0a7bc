from moeshard.cli import main

raise SystemExit(main())
