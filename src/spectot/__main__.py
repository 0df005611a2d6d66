from spectot.cli.main import main

raise SystemExit(main())
