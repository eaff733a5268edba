from tiered.cli import main

raise SystemExit(main())
