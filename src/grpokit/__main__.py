from grpokit.cli import main

raise SystemExit(main())
