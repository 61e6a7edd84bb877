"""What a SRC is: training layouts (`layouts`: one module per framework), run folders (`runs`:
one judge, any storage), and the door above both that every operation opens its SRC through
(`opening`: `open_source`, `check_source`)."""
