"""The distributed plumbing under the roles: Ray clusters and placement, worker groups (local or Ray) and their
dispatch, the shard layouts of trainers and engines, and the weight transfers between them."""
