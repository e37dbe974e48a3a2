from tgraph.cli import main

raise SystemExit(main())
