from dropless.cli.main import main

raise SystemExit(main())
