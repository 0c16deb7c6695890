"""The command line. Only this package maps exceptions to exit codes; domain code never imports it."""
