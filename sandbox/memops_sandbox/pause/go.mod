module memops.dev/pause

go 1.26.0
