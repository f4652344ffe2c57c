"""How compressed K/V is held: the quantizers (`quant`), tier formats and page byte layouts (`layout`), each format's
encode/decode pair (`codec`), the page arena (`pages`), and the store in three layers: `page_table.PageTable`
(allocation, addressing), `scores.Scores` (score and position words, holes, crop) and `store.CompressedStore` (the
tokens' bytes). `bases` makes the rotations and bases the store's vectors are expressed in."""
